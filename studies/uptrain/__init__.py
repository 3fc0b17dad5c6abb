"""The GQA paper's uptraining claims (Ainslie et al. 2023), tested as the
paper states them, with controls (`python -m scripts.uptrain_study`, whose
docstring is the study's manual), in two designs: one source
(`single_source`) and sources replicated over lengths (`replicated`).

  design              constants, the conversions (`Arm`), configs, and the
                      layouts planned by cache bytes (MLA, GTA, GLA, TPA)
  runs                the source, the conversions, uptraining, scratch runs
  single_source       the single-source design's runs (pilot, arms, recall)
  replicated          the source-replicated design's runs
  common              what both read alike: scratch-equivalent steps,
                      claim 2's verdict, the provenance sentence
  single_summary      the single-source statistics (every reported number)
  single_reading,     its report: the reading, the tables and text, the
  single_tables,      plots
  single_plots
  replicated_summary  the replicated statistics (intervals over sources)
  replicated_report   its report: the reading, the tables, the plot
  results             results.json and the report of its design (`write`,
                      `rebuild` for --report_only)
"""

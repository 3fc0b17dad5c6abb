"""MHA, GQA and MQA trained on the same data and budget, and compared
(`python -m scripts.compare`, whose docstring is the study's manual).

  design    what is trained: each variant's config, the negative control's
            (no context) and the A/A control's (K/V initialisation redrawn)
  runs      training them (`studies.study.train`), timing decoding, and
            results.json's values as the runs gave them (`runs.run`)
  analysis  what is read from those values: paired differences against
            the reference, the verdicts on the papers' claims, the controls
  text      report.md, a function of results.json alone (`text.write`,
            `text.rebuild` for --report_only)
  plots     loss.png and throughput.png
"""

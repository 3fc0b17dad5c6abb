"""The KV-memory frontier on a task where the cache matters
(`python -m scripts.kv_frontier`, whose docstring is the study's manual).

  design    the layouts (`Variant`), the panels, the families of pairs
            read together (`Family`), each variant's config,
            the plan the flags ask for, a saved model's place (`point`)
  measure   training the runs and the conversions, and reading each model
            through a float and an int8 decode cache (`measure.run`)
  analysis  what is read from the per-seed values: the control, the pairs,
            the main effects, the families, int8 against float, the
            frontier
  tables    report.md, a function of frontier.json alone (`tables.write`,
            `tables.rebuild` for --report_only)
  reading   its '## What it shows', sentences made from the numbers
  plot      frontier.png
"""

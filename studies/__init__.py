"""The study machinery: the statistics every study reports with
(`studies.stats`), runs trained once and reused (`studies.study`), timing
(`studies.timing`), task scores (`studies.task_scores`) and the reports.
The commands that drive it are in scripts/ (python -m scripts.NAME); it
imports the model, training, serving and evaluation, and none of them
imports it."""

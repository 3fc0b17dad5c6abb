"""The study machinery, under the commands of scripts/ (python -m
scripts.NAME) and over everything else: it imports the model, training,
serving and evaluation, and none of them imports it.

  stats        the one statistics convention every report states and
               applies (`stats.decision`: every verdict on a difference
               and its reason, in the words every report prints)
  study        the flags every study takes, runs trained once and reused
               only under their settings, results saved as strict JSON
  timing       medians taken in turns, read bandwidth, a decode step, the
               one-at-a-time peer and the machine a figure is printed beside
  task_scores  lm-evaluation-harness scores of a study's runs, paired
  report       what every report.md is made of (provenance sentences, the
               rebuild line, intervals, tables, sections, figures, plots)
  variants     the layouts a benchmark names on its command line (K2,
               GTA2, MLA48, TPA2, ...; bench_decode's and bench_serve's)
  llama_cpp_peer  llama.cpp on the same model (GGUF), in a process of its
               own: bench_decode's and bench_serve's peer

and one package a study, each its design, runs, analysis and report (a
function of its saved results alone, so `--report_only` rebuilds it byte
for byte): `compare`, `kv_frontier`, `uptrain`, and `recall_sweep` (one
module).

A published report (docs/results/) names clean commits: where its numbers
were measured and where it was last rebuilt, each run's record named
where it lacks one (`report.published_problems`, which the tests that
rebuild the published reports apply). A rebuild writes the files it
rebuilds, so rebuilding several reports takes a commit after each: the
next would otherwise be made on a dirty tree, and say so.
"""

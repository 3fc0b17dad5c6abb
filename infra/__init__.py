"""Shared infrastructure, importing nothing else of gqa-lab: errors as one
line (`infra.errors`), command-line shells (`infra.cli`), local and gs://
paths (`infra.storage`), workdirs and their lock (`infra.workdir`), the
provenance a published number carries (`infra.provenance`), progress lines,
signals as a stop at a step, and a multi-process run's watcher
(`infra.peers`)."""

"""Watching what fleet deployed: scrape targets and alert rules for Prometheus, the per-instance
status model, and workloads derived from observed traffic (``fleet monitor``, ``fleet status``,
``fleet plan --observed``)."""

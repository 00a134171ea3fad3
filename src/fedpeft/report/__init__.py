"""Results on disk (config, metrics.jsonl, summary.json), plots and run comparisons."""

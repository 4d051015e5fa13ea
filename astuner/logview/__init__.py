"""The log viewer: a local web app over a run's metrics.jsonl and logview.sqlite (`--with-logview`,
`astuner logview PATH`)."""

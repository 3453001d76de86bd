"""Every benchmark of docs/benchmarks.md, one ``duplexserve bench`` subcommand each, built on loadgen."""

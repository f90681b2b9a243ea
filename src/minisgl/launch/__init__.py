"""Starting and supervising processes: the server's launcher, its children and several machines,
the command-line arguments and the config chain; used by `minisgl serve` and by `LLM(tp=N)`."""

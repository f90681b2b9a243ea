"""The command line (`minisgl serve | chat | bench`) and the terminal chat."""

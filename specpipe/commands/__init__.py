"""Click commands, one module each; registered in specpipe/cli.py."""

"""`dspark <command>`: argument parsing and printing only; the library does the work."""

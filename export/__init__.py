"""eyas.export: the serving file format (DESIGN §1, §5.1)."""

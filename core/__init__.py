"""Helpers every stage shares: token sampling, acceptance arithmetic, precision, packaged
assets, Hub ids, the serving-engine subprocess, the allocator setting."""

"""Shared by the tests of every stage: fakes (an OpenAI server, a states engine, the Hub,
vLLM), tiny targets and heads, run fixtures, and the recorded files (golden/, fixtures/,
templates/). Imported as `support.<module>`: tests/conftest.py puts tests/ on the path."""

"""Code that runs inside a vLLM engine's own Python (`.venv-vllm`), loaded there by file
path: the hidden-states connector and the handover format it shares with eyas. Nothing
here imports eyas; eyas imports the format module as `eyas.data.vllm_plugin.eyas_states_format`.
"""

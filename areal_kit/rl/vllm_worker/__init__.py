"""What vLLM loads into its own worker processes (worker_extension_cls): the weight sync's last hop
into the parameters (extension.py) and LoRA adapters (lora_adapter.py). No code of ours runs there
otherwise; the engine names the extension by its dotted path."""

"""Who answers: the backend interface and registry, the non-LLM controls, the hf backend and its planning, the vLLM engine, the shared HTTP machinery and the provider backends."""

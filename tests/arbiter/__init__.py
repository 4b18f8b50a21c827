"""The decision core: schema, settings, prompt, model files, the engine on the real model."""

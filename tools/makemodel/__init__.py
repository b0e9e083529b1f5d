"""tools/make_model.py in parts: spec, tensors, tokens, generator, writers, driver, cli."""

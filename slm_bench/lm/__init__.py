"""Language models themselves: model presets and checkpoints, tokenizers with chat templates, and packing examples into rows."""

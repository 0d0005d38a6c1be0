"""configs/: frozen dataclass presets: model shapes, run presets, and the shipped tokenizer vocab"""

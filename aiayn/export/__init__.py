"""Export: a trained model for other inference engines (CTranslate2, Hugging Face transformers).

- ``convert``: the averaged model converted and checked against ours, with its tokenizer;
- ``engines``: translating with an exported model (and ours), each a batch translator;
- ``model_card``: the README.md of an exported model.
"""

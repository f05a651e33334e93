"""kdispatch inside other libraries' models: ``kdispatch.integrations.transformers``
puts kdispatch's ops into a loaded Hugging Face transformers model."""

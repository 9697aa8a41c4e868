"""Text generation from a trained GPT: a KV cache beside the model (the training forward is untouched),
tensor-parallel sampling, and the loop that ties them (`generate`)."""

"""Generation: sampling (`sampling`), the scheduler and plain loop (`decoding`), the text / chat / image front
end (`generate`), speculative decoding with the DSpark drafter (`speculative`, `drafter`), the tokenizer
(`tokenizer`), the chat format (`chat/`) and images in prompts (`image`, `multimodal`)."""

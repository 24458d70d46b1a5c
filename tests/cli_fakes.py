"""`minimax-ref generate` without a model: the command's calls of `generate()` recorded instead of run."""

from __future__ import annotations


class FakeResult:
    """What the command reads of one request's result."""

    token_ids, prompt_token_ids, finish_reason, stats, request = [1], [1], "stop", {}, {}

    def as_dict(self):
        return {"text": "x", "request": self.request, "stats": self.stats}


def capture_generate(monkeypatch) -> list[dict]:
    """Replace the model and generate(): each call's prompts and generate kwargs are appended to the returned list,
    and every prompt gets a `FakeResult`."""
    import minimax_ref.cli.generate as cli_generate
    import minimax_ref.generation.generate as gen

    calls: list[dict] = []

    def generate(model, tok, prompts, on_result=None, **kw):
        calls.append({"prompts": prompts, **kw})
        for row in range(len(prompts)):
            on_result(row, FakeResult())
        return [FakeResult() for _ in prompts]

    model = type("Model", (), {"max_seq_len": 4096})()  # what the command reads of the model itself
    tok = type("Tokenizer", (), {"eos_token_ids": (2,), "path": "tokenizer"})()  # what the command reads of it
    monkeypatch.setattr(cli_generate, "load_from_args", lambda args: (model, tok, None))
    monkeypatch.setattr(gen, "generate", generate)
    return calls

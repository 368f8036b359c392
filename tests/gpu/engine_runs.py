"""Running requests through an engine to the end, as the GPU engine tests compare them."""


def run(engine, requests, new, **sampling):
    """Add every prompt of ``requests`` at once (``new`` tokens each, no stop token), step the engine
    until nothing is left, and return each request's output tokens."""
    seqs = [engine.add_request(p, new, stop_token_ids=[], **sampling) for p in requests]
    while engine.has_work:
        engine.step()
    return [s.output for s in seqs]

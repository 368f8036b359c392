"""Running requests through an engine to the end, and recording the logits of its picks, as the GPU
engine tests compare them."""


def run(engine, requests, new, **sampling):
    """Add every prompt of ``requests`` at once (``new`` tokens each, no stop token), step the engine
    until nothing is left, and return each request's output tokens."""
    seqs = [engine.add_request(p, new, stop_token_ids=[], **sampling) for p in requests]
    while engine.has_work:
        engine.step()
    return [s.output for s in seqs]


def record_logits(engine):
    """Record from now on the fp32 logits of every row the engine picks a token for, as
    {(sequence id, position): logits [V] on the CPU} (the dict returned), by replacing its runner's
    pick with greedy picks of those logits; ``del engine.runner.pick`` ends it."""
    seen = {}

    def recording(h, slots, positions, keep, masked=False, scores=None):
        owners = {s.slot: s for s in engine.scheduler.running}
        logits = engine.model.logits(h)
        for row, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist())):
            if slot in owners:  # not a padded prompt step's pick on the scratch row
                seen[(owners[slot].id, pos)] = logits[row].float().cpu()
        return logits.argmax(-1)

    engine.runner.pick = recording
    return seen

"""The contract floor: the types that pass between stages, below every stage.

    manifest.py    engines/<name>/manifest.json: what the builder writes and every later stage reads
    costs.py       step and batch costs measured at build, read by adaptive K and the batch planner
    quant.py       quantization mode and config, accuracy budget and report
    generation.py  sampling and generation config: one request's settings
    drafts.py      draft kinds, prompt lookup's config, a batch-size -> K schedule
"""

"""The decode engine: admission, continuous batching and the draft/build/verify/accept/commit loop.

    engine = build_local_engine(ModelSetup(target=dir, drafter=dir)).start()   # ddtree.engine.loader
    handle = engine.submit(validate_request(prompt_ids, limits=engine.limits, mode="ddtree"))
    for event in handle: ...                                                     # Chunk..., Usage
"""

"""Driving a Deployment step by step in tests, so reshapes can happen while requests are mid-decode."""


def run_steps(dep, ids, done, num_steps=None):
    """Step until every request in `ids` finished (or `num_steps` steps ran); finished token ids go into `done`
    (request id -> tokens), which is returned."""
    steps = 0
    while len(done) < len(ids) and (num_steps is None or steps < num_steps):
        if not dep.has_unfinished_requests():
            raise AssertionError(f"requests {sorted(set(ids) - set(done))} are neither running nor finished here")
        for out in dep.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return done

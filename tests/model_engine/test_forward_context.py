"""The forward context is per thread: two engines on two threads do not mix metadata."""

import threading

from atom.forward_context import AttentionMetadata, forward_context, get_forward_context


def test_each_thread_sees_its_own_metadata():
    seen = {}
    inside = threading.Barrier(2)

    def run(name: str, max_seqlen: int):
        metadata = AttentionMetadata(None, None, None, None, max_seqlen, False)
        with forward_context(metadata):
            inside.wait()  # both threads are inside their context now
            seen[name] = get_forward_context().attention.max_seqlen_q

    threads = [threading.Thread(target=run, args=(n, i)) for i, n in enumerate(("a", "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"a": 0, "b": 1}

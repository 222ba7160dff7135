"""freeze_heap: start-up's objects leave the collector's walks; the interpreter gets them back
at exit."""
import atexit
import gc

from workers.engine import freeze_heap


def test_freeze_heap_freezes_live_objects_and_hands_them_back_at_exit(monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn))
    monkeypatch.setattr(atexit, "unregister", lambda fn: None)
    before = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # tracked containers alive at the call
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= before + len(kept)
        assert registered == [gc.unfreeze]       # handed back at exit
        gc.collect()                             # a full collection leaves them frozen
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0

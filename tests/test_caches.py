"""The cache registry: every cache made through it is listed and emptied by clear_cache."""

import threading

from meshinit import _caches


def test_an_lru_keeps_the_most_recently_put_entries():
    cache = _caches.LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 3)  # "a" is now the newest
    cache.put("c", 4)
    assert dict(cache) == {"a": 3, "c": 4}


def test_clear_cache_empties_every_kind_of_registered_cache_under_its_lock():
    lock = threading.Lock()
    lru = _caches.lru("test lru", 4, lock)
    weak = _caches.weak("test weak")

    @_caches.memo(4)
    def square(x):
        return x * x

    class Key:
        pass

    key = Key()
    lru.put("k", 1)
    weak[key] = 1
    square(3)
    assert {id(c) for _, c in _caches.registered()} >= {id(lru), id(weak), id(square)}
    assert _caches.size(lru) == _caches.size(weak) == _caches.size(square) == 1
    with lock:  # a compile thread holds it: clearing waits, never races the put
        cleared = threading.Thread(target=_caches.clear_cache)
        cleared.start()
        cleared.join(0.2)
        assert cleared.is_alive() and _caches.size(lru) == 1
    cleared.join()
    assert _caches.size(lru) == _caches.size(weak) == _caches.size(square) == 0

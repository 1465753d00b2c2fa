"""The token cache: known tokens for a few seconds, bounded; unknown tokens never kept."""

import secrets

from app.gateway.auth import Principal, TokenCache, hash_token, new_token

ALICE = Principal(token_id=1, member="alice", default_class="chat", allowed_classes=())


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_known_token_is_read_once_per_ttl():
    token, clock, asked = new_token(), Clock(), []
    cache = TokenCache(lambda h: asked.append(h) or ALICE, ttl_s=5.0, clock=clock)
    assert cache.lookup(token) == ALICE and cache.lookup(token) == ALICE
    assert asked == [hash_token(token)]
    clock.now += 5.0  # a revocation made by the CLI applies at the latest now
    assert cache.lookup(token) == ALICE
    assert len(asked) == 2


def test_a_flood_of_unknown_tokens_keeps_nothing():
    asked = []
    cache = TokenCache(lambda h: asked.append(h), clock=Clock())
    for _ in range(2000):
        assert cache.lookup("hth_" + secrets.token_urlsafe(32)) is None
    assert cache.num_cached() == 0
    # Nor is a refusal remembered: a token created a moment ago works on its next request.
    token = new_token()
    cache.lookup(token)
    cache.lookup(token)
    assert asked[-2:] == [hash_token(token)] * 2


def test_known_tokens_are_bounded_least_recently_used_first():
    asked = []
    cache = TokenCache(lambda h: asked.append(h) or ALICE, clock=Clock(), max_entries=8)
    tokens = [new_token() for _ in range(20)]
    for t in tokens:
        cache.lookup(t)
    assert cache.num_cached() == 8
    asked.clear()
    cache.lookup(tokens[-1])  # recent: still cached
    cache.lookup(tokens[0])  # the oldest: evicted, read again
    assert asked == [hash_token(tokens[0])]


def test_clear_forgets_every_token():
    token, asked = new_token(), []
    cache = TokenCache(lambda h: asked.append(h) or ALICE, clock=Clock())
    cache.lookup(token)
    cache.clear()
    cache.lookup(token)
    assert len(asked) == 2

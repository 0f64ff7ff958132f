"""inbox.claim: the first transaction to claim a message id owns it; a racing duplicate waits
and learns whether the first committed."""

import threading
import time
import uuid

import psycopg
import pytest


def new_id(db) -> uuid.UUID:
    return db.execute("SELECT outbox.uuid_v7()").fetchone()[0]


def test_first_claim_wins_and_duplicates_are_refused(db):
    mid = new_id(db)
    assert db.execute("SELECT inbox.claim(%s, 'billing')", (mid,)).fetchone()[0] is True
    assert db.execute("SELECT inbox.claim(%s, 'billing')", (mid,)).fetchone()[0] is False
    assert db.execute("SELECT inbox.claim(%s, 'shipping')", (mid,)).fetchone()[0] is True, "per consumer"


def test_claim_rolls_back_with_the_effect(db, connect):
    mid = new_id(db)
    tx = connect(autocommit=False)
    assert tx.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0]
    tx.rollback()   # the effect failed: the message was not processed
    assert db.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0] is True


@pytest.mark.parametrize("first_commits", [True, False])
def test_a_racing_duplicate_waits_for_the_first(db, connect, first_commits):
    mid = new_id(db)
    first, second = connect(autocommit=False), connect(autocommit=False)
    assert first.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0]
    result = {}

    def racer():
        result["owned"] = second.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0]
        result["at"] = time.monotonic()

    t = threading.Thread(target=racer)
    t.start()
    time.sleep(0.3)
    assert "owned" not in result, "the duplicate must wait for the first transaction"
    decided = time.monotonic()
    first.commit() if first_commits else first.rollback()
    t.join(5)
    assert result["at"] >= decided
    assert result["owned"] is (not first_commits)
    second.commit()


def test_messages_land_in_dated_partitions(db):
    mid = new_id(db)
    db.execute("SELECT inbox.claim(%s, 'c')", (mid,))
    part = db.execute("SELECT tableoid::regclass::text FROM inbox.messages").fetchone()[0]
    assert part.startswith("inbox.messages_p"), part
    assert abs(db.execute("SELECT extract(epoch FROM inbox.uuid_time(%s) - now())", (mid,)).fetchone()[0]) < 5


def test_ids_that_are_not_uuidv7_dedup_too(db):
    mid = uuid.uuid4()
    assert db.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0] is True
    assert db.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0] is False


def test_bad_input(db):
    with pytest.raises(psycopg.errors.NullValueNotAllowed) as err:
        db.execute("SELECT inbox.claim(NULL, 'c')")
    assert err.value.diag.message_hint
    # a consumer name too long for the dedup index: said so, not an index row size error
    for consumer in ("", "".join(chr(0x4e00 + i) for i in range(3000))):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
            db.execute("SELECT inbox.claim(%s, %s)", (new_id(db), consumer))
        assert "1 to 128" in str(err.value) and err.value.diag.message_hint


def test_uuid_at_holds_any_moment_to_a_uuidv7s_48_bits_of_time(db):
    rows = db.execute("SELECT inbox.uuid_at(t)::text FROM unnest(ARRAY['1960-01-01', '-infinity', "
                      "'infinity', '1970-01-01 00:00:00.001+00']::timestamptz[]) t").fetchall()
    assert [r[0] for r in rows] == ["00000000-0000-7000-8000-000000000000"] * 2 + [
        "ffffffff-ffff-7000-8000-000000000000", "00000000-0001-7000-8000-000000000000"]


def test_consumer_roles_can_claim(connect):
    for user in ("producer_user", "relay_user"):
        conn = connect(user)
        assert conn.execute("SELECT inbox.claim(gen_random_uuid(), 'c')").fetchone()[0] is True
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        connect("nobody_user").execute("SELECT inbox.claim(gen_random_uuid(), 'c')")

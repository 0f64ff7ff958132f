"""An event exists if and only if the transaction that emitted it commits: plain, savepoints,
procedures that COMMIT and ROLLBACK inside, triggers, two-phase commit, and a client in
another language than SQL (Python, through plain SQL)."""

import psycopg
import pytest

from support.db import count_events

EMIT = "SELECT outbox.emit('order', %s, 'order.created', '{}')"


def keys(conn):
    return [r[0] for r in conn.execute("SELECT aggregate_id FROM outbox.events ORDER BY seq").fetchall()]


def test_commit_keeps_the_event_and_rollback_discards_it(db, connect):
    tx = connect(autocommit=False)
    tx.execute(EMIT, ("committed",))
    assert count_events(db) == 0, "not visible before commit"
    tx.commit()
    tx.execute(EMIT, ("rolled-back",))
    tx.rollback()
    assert keys(db) == ["committed"]


def test_event_and_business_row_commit_or_vanish_together(db, connect):
    db.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    tx = connect(autocommit=False)
    tx.execute("INSERT INTO orders VALUES (1)")
    tx.execute(EMIT, ("1",))
    tx.commit()
    tx.execute("INSERT INTO orders VALUES (2)")
    tx.execute(EMIT, ("2",))
    with pytest.raises(psycopg.errors.UniqueViolation):
        tx.execute("INSERT INTO orders VALUES (1)")
    tx.rollback()
    assert keys(db) == ["1"]
    assert db.execute("SELECT array_agg(id) FROM orders").fetchone()[0] == [1]


def test_savepoint_rollback_discards_only_its_events(db, connect):
    tx = connect(autocommit=False)
    tx.execute(EMIT, ("before",))
    tx.execute("SAVEPOINT s1")
    tx.execute(EMIT, ("inside",))
    tx.execute("ROLLBACK TO SAVEPOINT s1")
    tx.execute("SAVEPOINT s2")
    tx.execute(EMIT, ("kept-savepoint",))
    tx.execute("RELEASE SAVEPOINT s2")
    tx.execute(EMIT, ("after",))
    tx.commit()
    assert keys(db) == ["before", "kept-savepoint", "after"]


def test_plpgsql_exception_block_rolls_back_its_events(db):
    db.execute("""
        DO $$
        BEGIN
            PERFORM outbox.emit('order', 'outer', 'e', '{}');
            BEGIN
                PERFORM outbox.emit('order', 'inner', 'e', '{}');
                RAISE EXCEPTION 'boom';
            EXCEPTION WHEN OTHERS THEN NULL;
            END;
        END $$""")
    assert keys(db) == ["outer"]


def test_procedure_with_commit_and_rollback_inside(db):
    db.execute("""
        CREATE PROCEDURE place_orders() LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM outbox.emit('order', 'p1', 'e', '{}');
            COMMIT;
            PERFORM outbox.emit('order', 'p2', 'e', '{}');
            ROLLBACK;
            PERFORM outbox.emit('order', 'p3', 'e', '{}');
            COMMIT;
            PERFORM outbox.emit('order', 'p4', 'e', '{}');
            RAISE EXCEPTION 'fails after the last commit';
        END $$""")
    with pytest.raises(psycopg.errors.RaiseException):
        db.execute("CALL place_orders()")
    assert keys(db) == ["p1", "p3"]
    txids = db.execute("SELECT txid FROM outbox.events ORDER BY seq").fetchall()
    assert txids[0] != txids[1], "each COMMIT inside the procedure starts a new transaction"


def test_trigger_on_a_business_table_emits(db, connect):
    db.execute("""
        CREATE TABLE orders (id int PRIMARY KEY, total int);
        CREATE FUNCTION orders_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM outbox.emit('order', NEW.id::text, 'order.' || lower(TG_OP), to_jsonb(NEW));
            RETURN NEW;
        END $$;
        CREATE TRIGGER orders_outbox AFTER INSERT OR UPDATE ON orders
            FOR EACH ROW EXECUTE FUNCTION orders_outbox();""")
    db.execute("INSERT INTO orders VALUES (1, 10), (2, 20)")
    db.execute("UPDATE orders SET total = 11 WHERE id = 1")
    tx = connect(autocommit=False)
    tx.execute("INSERT INTO orders VALUES (3, 30)")
    tx.rollback()
    rows = db.execute("SELECT aggregate_id, event_type, payload->>'total' FROM outbox.events ORDER BY seq").fetchall()
    assert rows == [("1", "order.insert", "10"), ("2", "order.insert", "20"), ("1", "order.update", "11")]


def test_two_phase_commit(db, connect):
    for key, finish in [("prepared-commit", "COMMIT PREPARED"), ("prepared-rollback", "ROLLBACK PREPARED")]:
        tx = connect()
        tx.execute("BEGIN")
        tx.execute(EMIT, (key,))
        tx.execute(f"PREPARE TRANSACTION '{key}'")
        tx.close()
        assert count_events(db, "aggregate_id = %s", (key,)) == 0, "invisible while prepared"
        db.execute(f"{finish} '{key}'")
    assert keys(db) == ["prepared-commit"]


def test_emit_many_is_atomic_with_the_transaction(db, connect):
    tx = connect(autocommit=False)
    tx.execute("SELECT outbox.emit_many('a', 'e', %s, %s::jsonb[])", (["1", "2"], ["{}", "{}"]))
    tx.rollback()
    tx.execute("SELECT outbox.emit_many('a', 'e', %s, %s::jsonb[])", (["3", "4"], ["{}", "{}"]))
    tx.commit()
    assert keys(db) == ["3", "4"]


def test_a_client_in_another_language_uses_plain_sql(cluster, dbname, db):
    """The application here is Python (psycopg, server-side parameters, no extension-specific
    client code), doing its own business write and the emit in one transaction."""
    with psycopg.connect(cluster.dsn(dbname, "producer_user")) as app:
        with app.transaction():
            event_id = app.execute("SELECT outbox.emit(%s, %s, %s, %s::jsonb, %s::jsonb, %s)",
                                   ("invoice", "inv-7", "invoice.paid", '{"amount": 12.5}',
                                    '{"source": "python"}', "billing")).fetchone()[0]
        with pytest.raises(ZeroDivisionError):
            with app.transaction():
                app.execute("SELECT outbox.emit('invoice', 'inv-8', 'invoice.paid', '{}')")
                raise ZeroDivisionError
    rows = db.execute("SELECT id, aggregate_id, headers FROM outbox.events").fetchall()
    assert rows == [(event_id, "inv-7", {"source": "python"})]

-- outbox_ext: time partitions of the event log (and, later, of the inbox).
--
-- Partitions are aligned to multiples of their width since the Unix epoch, named
-- <parent>_pYYYYMMDD_HH24MISS after their lower bound in UTC, and created ahead of time.
-- A default partition catches rows outside every range so that emit never fails for want of
-- a partition; outbox.maintain() reports and moves such rows.

CREATE FUNCTION outbox._ensure_partitions(parent regclass, width interval, ahead int)
RETURNS int
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    step    double precision := extract(epoch FROM width);
    nsp     text;
    rel     text;
    lower   timestamptz;
    created int := 0;
BEGIN
    IF width IS NULL OR step <= 0 OR extract(month FROM width) <> 0 OR extract(year FROM width) <> 0 THEN
        RAISE EXCEPTION 'partition width % is not a fixed, positive interval', width
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Use a width in days, hours or minutes, e.g. ''1 day''.';
    END IF;
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = parent;
    lower := to_timestamp(floor(extract(epoch FROM now()) / step) * step);
    FOR i IN 0 .. greatest(ahead, 0) LOOP
        IF to_regclass(format('%I.%I', nsp, outbox._partition_name(rel, lower))) IS NULL THEN
            EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.%I FOR VALUES FROM (%L) TO (%L)',
                           nsp, outbox._partition_name(rel, lower), nsp, rel,
                           lower, lower + width);
            created := created + 1;
        END IF;
        lower := lower + width;
    END LOOP;
    RETURN created;
END
$$;
COMMENT ON FUNCTION outbox._ensure_partitions(regclass, interval, int) IS
    'Creates the partition holding now() and the next AHEAD ones, where missing; returns how many it created.';

CREATE FUNCTION outbox._partition_name(parent text, lower timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN parent || '_p' || pg_catalog.to_char(lower AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');

CREATE TABLE outbox.events_default PARTITION OF outbox.events DEFAULT;
SELECT outbox._ensure_partitions('outbox.events', '1 day', 2);

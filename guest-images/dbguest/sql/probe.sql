-- CPU probe, in the postgres database: seconds of pure computation (SHA-256 of n integers). Run natively at
-- build time and in the guest after boot, the ratio is the guest's CPU slowdown under emulation.
CREATE FUNCTION scalebench_cpu_probe(n int) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    t0 timestamptz := clock_timestamp();
    c bigint;
BEGIN
    SELECT count(sha256(int4send(g))) INTO c FROM generate_series(1, n) g;
    RETURN extract(epoch FROM clock_timestamp() - t0);
END $$;

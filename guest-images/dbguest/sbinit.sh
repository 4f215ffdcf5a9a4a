#!/bin/sh
# PID 1 of the database guest: mount the kernel file systems, bring up the
# user-mode network (QEMU slirp: 10.0.2.15/24, gateway 10.0.2.2), start
# PostgreSQL and say so on the serial console. The host ends the guest by
# destroying the domain; every run works on a throw-away overlay.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t devpts devpts /dev/pts
mount -o remount,rw,noatime /
mount -t tmpfs -o mode=755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
modprobe virtio_net
nic=""
for _ in $(seq 1 100); do
    nic=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)
    [ -n "$nic" ] && break
    sleep 0.1
done
echo "scalebench-dbguest: network interface '${nic}'" > /dev/console
ip link set lo up
ip link set "$nic" up
ip addr add 10.0.2.15/24 dev "$nic"
ip route add default via 10.0.2.2
mkdir -p /run/postgresql
chown postgres:postgres /run/postgresql
# scalebench.db_cache_max=<bytes> on the kernel command line: the page cache of
# the server's files is held to about that, so the kernel's cache cannot act as
# a second buffer pool (the study's engines did direct I/O; PostgreSQL 15
# cannot). Twice a second the cache above it is reclaimed (cgroup v2
# memory.reclaim; with no swap the kernel can reclaim only clean cache). The
# server's own memory is not limited: a cap on all of it killed TPC-W's server
# (memory.max at 64 MiB: 4 backends sorting beside 24 MB of shared buffers) or
# stalled it (memory.high: no cache left to reclaim).
hold_cache() {
    group=/sys/fs/cgroup/db
    while :; do
        while read -r key value; do
            case $key in
                file) file=$value ;;
                shmem) shmem=$value ;;
            esac
        done < $group/memory.stat
        # memory.stat's file counts shmem (the shared buffers), which is not cache.
        over=$((file - shmem - $1))
        [ "$over" -gt 0 ] && echo "$over" > $group/memory.reclaim 2> /dev/null
        sleep 0.5
    done
}
db_cache_max=$(sed -n 's/.*scalebench\.db_cache_max=\([0-9]*\).*/\1/p' /proc/cmdline)
if [ -n "$db_cache_max" ]; then
    mount -t cgroup2 none /sys/fs/cgroup
    echo +memory > /sys/fs/cgroup/cgroup.subtree_control
    mkdir /sys/fs/cgroup/db
    hold_cache "$db_cache_max" &
    echo "scalebench-dbguest: database page cache held to $db_cache_max bytes" > /dev/console
fi
(
    [ -n "$db_cache_max" ] && echo 0 > /sys/fs/cgroup/db/cgroup.procs
    exec runuser -u postgres -- /usr/lib/postgresql/15/bin/pg_ctl -D /var/lib/postgresql/15/main \
        -w -t 600 -l /run/postgresql/server.log \
        -o "-c config_file=/etc/postgresql/15/main/postgresql.conf" start
)
if [ $? -eq 0 ]; then
    echo "SCALEBENCH-DB-READY" > /dev/console
else
    echo "SCALEBENCH-DB-FAILED" > /dev/console
    cat /run/postgresql/server.log > /dev/console
fi
while :; do sleep 3600; done

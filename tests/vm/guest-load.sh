# guest-load.sh - sourced by the guest side of the failover tests (e2e-group-guest.sh,
# e2e-k8s-guest.sh): fio --verify plus a pause probe on a multipath head, and the probe's
# longest gap. Needs, from the sourcing script: WORK, LOGDIR, MIB, FIO_MIB, FIO_RATE,
# PROBE_OFF_MIB, and the functions say and head_dev (NSID -> /dev/nvmeXnY).
cat > "$WORK/probe.py" <<'PY'
# probe DEV OFFSET STOPFILE LOG: 4K O_DIRECT writes back to back over a 1 MiB ring, each
# completion time (CLOCK_BOOTTIME = /proc/uptime) logged; at the stop file, every block is read
# back and must hold the last sequence number written there. Prints a summary line.
import mmap, os, struct, sys, time
dev, off, stopf, logf = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
BS, N = 4096, 256
clock = lambda: time.clock_gettime(time.CLOCK_BOOTTIME)
fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
buf = mmap.mmap(-1, BS)
last, seq, errors = {}, 0, 0
with open(logf, "w", buffering=1) as log:
    while not os.path.exists(stopf):
        seq += 1
        slot = seq % N
        buf.seek(0)
        buf.write(struct.pack("<QQ", seq, slot) + bytes([seq & 0xFF]) * (BS - 16))
        try:
            os.pwrite(fd, buf, off + slot * BS)
            last[slot] = seq
            log.write("%.4f\n" % clock())
        except OSError as e:
            errors += 1
            last.pop(slot, None)
            log.write("E %.4f %s\n" % (clock(), e.strerror))
            time.sleep(0.05)
        time.sleep(0.002)
bad = 0
for slot, s in last.items():
    os.preadv(fd, [buf], off + slot * BS)
    if struct.unpack("<QQ", buf[:16]) != (s, slot) or buf[16:] != bytes([s & 0xFF]) * (BS - 16):
        bad += 1
print("probe writes=%d errors=%d verify_bad=%d" % (seq - errors, errors, bad))
PY

FIO_PID="" PROBE_PID="" LOAD=""
load_start() { # NAME NSID: fio verify on [0, FIO_MIB) and the probe at PROBE_OFF_MIB
  local d; d=$(head_dev "$2") || { say "no head for nsid $2"; return 1; }
  LOAD=$WORK/$1
  rm -f "$LOAD".*
  # SIGPIPE ignored, as QEMU and most services run. In one CI run fio's job died of signal
  # 13 at the instant gw1 was killed (no I/O error, the probe unharmed). Our reading, not
  # traced: Linux's nvme-tcp host can send a command from the submitting process, and a
  # send that meets the killed gateway's reset raises SIGPIPE there. The driver sees EPIPE
  # either way and reconnects; the probe is Python, which ignores SIGPIPE.
  (cd /tmp && trap '' PIPE && exec timeout -k 10 300 fio --name="$1" --filename="$d" --direct=1 --ioengine=libaio \
     --rw=randwrite --bs=4k --offset=0 --size=${FIO_MIB}M --iodepth=4 --rate_iops=$FIO_RATE \
     --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 \
     --output-format=json --output="$LOAD.fio.json") > "$LOAD.fio.stderr" 2>&1 &
  FIO_PID=$!
  python3 "$WORK/probe.py" "$d" $((PROBE_OFF_MIB * MIB)) "$LOAD.stop" "$LOAD.probe.log" > "$LOAD.probe.out" 2>&1 &
  PROBE_PID=$!
  sleep 3
  kill -0 "$FIO_PID" 2>/dev/null && kill -0 "$PROBE_PID" 2>/dev/null ||
    { say "fio or the probe ended early: $(cat "$LOAD.fio.stderr" "$LOAD.probe.out")"; return 1; }
  say "fio (4K randwrite QD4 ${FIO_RATE} IOPS, ${FIO_MIB} MiB, crc32c verify) and the probe running on $d"
}
# load_finish: waits for fio, stops the probe; checks zero errors; sets FIO_CLAT_MAX_MS
FIO_CLAT_MAX_MS=0
load_finish() {
  local rc prc ok=0
  wait "$FIO_PID"; rc=$?
  touch "$LOAD.stop"; wait "$PROBE_PID"; prc=$?
  FIO_PID="" PROBE_PID=""
  cp "$LOAD.fio.json" "$LOAD.probe.log" "$LOGDIR/" 2>/dev/null
  local fio_error w_ios r_ios
  read -r fio_error w_ios r_ios FIO_CLAT_MAX_MS < <(python3 - "$LOAD.fio.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))["jobs"][0]
    print(j["error"], j["write"]["total_ios"], j["read"]["total_ios"], "%.0f" % (j["write"]["clat_ns"]["max"] / 1e6))
except Exception:
    print("parse-error 0 0 0")
PY
)
  say "fio rc=$rc error=$fio_error writes=$w_ios verify reads=$r_ios max write latency ${FIO_CLAT_MAX_MS} ms; $(cat "$LOAD.probe.out")"
  [ $rc -eq 0 ] && [ "$fio_error" = 0 ] || { say "fio failed: $(tail -n 5 "$LOAD.fio.stderr")"; ok=1; }
  [ "$w_ios" -ge $((FIO_MIB * 256)) ] 2>/dev/null || { say "fio wrote $w_ios blocks, not the whole ${FIO_MIB} MiB"; ok=1; }
  [ $prc -eq 0 ] && grep -q 'errors=0 verify_bad=0' "$LOAD.probe.out" || { say "probe errors (rc $prc)"; ok=1; }
  return $ok
}
# gap FROM TO: the probe's longest gap between consecutive completions with the later one
# after FROM and the earlier one before TO (seconds, 2 decimals)
gap() {
  awk -v a="$1" -v b="$2" '$1 != "E" { if (p != "" && $1 > a && p < b && $1 - p > m) m = $1 - p; p = $1 }
    END { printf "%.2f", m + 0 }' "$LOAD.probe.log"
}

#!/usr/bin/env bash
# A real single-node SLURM (slurmctld + slurmd + munged) on this machine, for the `slurm` test tier
# and CI. Debian 12 (slurm 22.05), run as root, no systemd needed: the daemons are started by hand.
#
#   launch/slurm/local_cluster.sh start  [STATE_DIR]   # idempotent; prints `export SLURM_CONF=...`
#   launch/slurm/local_cluster.sh status [STATE_DIR]   # daemons, sinfo, squeue; exit 1 if down
#   launch/slurm/local_cluster.sh stop   [STATE_DIR]   # cancels jobs, stops what start started
#
# STATE_DIR defaults to $LMFORGE_SLURM_DIR, else /tmp/lmforge-slurm. It holds slurm.conf, the
# controller state, slurmd's spool, the logs (slurmctld.log, slurmd.log, munged.log) and pid files.
# The script never installs packages; it needs:
#   apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurmctld slurmd slurm-client munge
#
# Finding the configuration. The conf lives in STATE_DIR/slurm.conf, and `start` also symlinks
# /etc/slurm/slurm.conf (the compiled-in default path) to it, unless that path holds a file that is
# not ours or LMFORGE_SLURM_ETC=0. With the link, every client (sinfo, sbatch, srun inside a job, the
# test suite's plain `sinfo -h` probe) finds the cluster with no environment at all; without it,
# export the SLURM_CONF line that `start` prints. `stop` removes the link again, so a stopped
# cluster makes `sinfo` fail (and the slurm tests skip) instead of timing out on a dead controller.
#
# Timing: AuthInfo=cred_expire=10 and sched_interval=2 make a requeued job start again about
# 10-15 s after it ended (default: ~2 min). slurmctld checks time limits and --signal warnings
# only every 30 s, so a `--signal=SIG@N` warning arrives up to ~30 s late (plan N >= 60).
# The node is declared with NodeAddr=127.0.0.1, so the hostname need not resolve.
set -euo pipefail

PATH="$PATH:/usr/sbin:/sbin"
APT_LINE='apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurmctld slurmd slurm-client munge'
ETC_CONF=/etc/slurm/slurm.conf
MARKER='# written by lmforge launch/slurm/local_cluster.sh'

usage() { echo "usage: $0 {start|stop|status} [STATE_DIR]" >&2; exit 2; }
die() { echo "local_cluster.sh: $*" >&2; exit 1; }

CMD=${1:-}
[[ -n $CMD ]] || usage
DIR=${2:-${LMFORGE_SLURM_DIR:-/tmp/lmforge-slurm}}
DIR=$(realpath -m -- "$DIR")
CONF=$DIR/slurm.conf
NODE=$(hostname -s)

# pid recorded in $DIR/NAME.pid, if that process is still alive
alive_pid() {
  local f=$DIR/$1.pid pid
  [[ -s $f ]] || return 1
  pid=$(<"$f")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

show_logs() {
  local f
  for f in munged slurmctld slurmd slurmctld.stderr slurmd.stderr; do
    [[ -s $DIR/$f.log ]] || continue
    echo "---- tail $DIR/$f.log" >&2
    tail -n 25 "$DIR/$f.log" >&2
  done
}

fail() { echo "local_cluster.sh: $*" >&2; show_logs; exit 1; }

require_tools() {
  local c
  [[ $(id -u) == 0 ]] || die "must run as root (it starts munged, slurmctld and slurmd)"
  for c in munged munge unmunge slurmctld slurmd sbatch srun sinfo squeue scontrol scancel; do
    command -v "$c" >/dev/null 2>&1 || die "'$c' not found; install SLURM with: $APT_LINE"
  done
}

start_munge() {
  if munge_works; then
    echo "munged: already running (reused; stop will leave it alone)"
    return
  fi
  # Key: 1024 random bits, owned by munge, mode 0400 (munged refuses a key others can read).
  if [[ ! -s /etc/munge/munge.key ]]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    if command -v mungekey >/dev/null 2>&1; then
      runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
    fi
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  rm -f "$DIR/munged.log"
  install -o munge -g munge -m 0644 /dev/null "$DIR/munged.log"
  # munged daemonizes and writes its pid file; we copy the pid into STATE_DIR.
  runuser -u munge -- munged --log-file="$DIR/munged.log" --pid-file=/run/munge/munged.pid \
    || fail "munged did not start"
  local i
  for i in $(seq 50); do munge_works && break; sleep 0.2; done
  munge_works || fail "munged started but munge/unmunge fails"
  cp /run/munge/munged.pid "$DIR/munged.pid"
}

write_conf() {
  # Node hardware as slurmd sees it: CPUs=2 Boards=1 SocketsPerBoard=1 ... RealMemory=...
  local hw
  hw=$(slurmd -C | head -n1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' | tr '\n' ' ')
  [[ $hw == *CPUs=* ]] || fail "could not read the node's hardware from 'slurmd -C'"
  cat >"$CONF" <<EOF
$MARKER (state: $DIR)
ClusterName=lmforge
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs wait cred_expire (default 120 s) before they may start again.
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups, no accounting daemon: works in containers.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
JobRequeue=1
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
# Finished jobs stay visible to scontrol/squeue -t all for 16-80 s (no sacct here). Also sets
# sbatch --wait's poll period: 2 s, then every 8 s (MinJobAge >= 18 would make it every 32 s).
MinJobAge=16
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=60
MessageTimeout=10
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE ${hw}State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

link_etc_conf() {
  [[ ${LMFORGE_SLURM_ETC:-1} != 0 ]] || return 0
  if [[ -e $ETC_CONF && ! -L $ETC_CONF ]] && ! grep -qF "$MARKER" "$ETC_CONF"; then
    echo "note: $ETC_CONF belongs to another installation; left alone (export SLURM_CONF)"
    return
  fi
  mkdir -p "$(dirname "$ETC_CONF")"
  ln -sfn "$CONF" "$ETC_CONF"
}

unlink_etc_conf() {
  if [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$CONF" ]]; then rm -f "$ETC_CONF"; fi
}

# Start a daemon in the foreground (-D) in its own session, output to STATE_DIR; record its pid.
start_daemon() {
  local name=$1; shift
  setsid "$name" -D -f "$CONF" "$@" </dev/null >"$DIR/$name.stderr.log" 2>&1 &
  echo $! >"$DIR/$name.pid.launch"
}

node_state() { SLURM_CONF=$CONF sinfo -h -n "$NODE" -o %T 2>/dev/null || true; }

cmd_start() {
  require_tools
  if alive_pid slurmctld >/dev/null && alive_pid slurmd >/dev/null && [[ -n $(node_state) ]]; then
    echo "already running: $DIR (node $NODE: $(node_state))"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  # Half-started from an earlier attempt: stop what is left, then start clean.
  if alive_pid slurmctld >/dev/null || alive_pid slurmd >/dev/null; then stop_daemons; fi
  mkdir -p "$DIR/state" "$DIR/spool"
  start_munge
  write_conf
  rm -f "$DIR"/slurm*.log "$DIR"/slurm*.pid "$DIR"/slurm*.pid.launch
  # -i: ignore unreadable state files from an unclean stop (jobs recovered when readable).
  start_daemon slurmctld -i
  start_daemon slurmd -N "$NODE"
  # Wait until the node has registered (idle); a drain recovered from old state is lifted.
  local i d state=""
  for i in $(seq 60); do
    state=$(node_state)
    [[ $state =~ ^(idle|mixed|allocated)$ ]] && break
    if [[ $state == drain* ]]; then
      SLURM_CONF=$CONF scontrol update NodeName="$NODE" State=RESUME || true
    fi
    for d in slurmctld slurmd; do
      kill -0 "$(<"$DIR/$d.pid.launch")" 2>/dev/null || fail "$d exited during start-up"
    done
    sleep 0.5
  done
  if [[ ! $state =~ ^(idle|mixed|allocated)$ ]]; then
    SLURM_CONF=$CONF sinfo -R >&2 || true
    fail "node $NODE not idle after 30 s (state: '${state:-no answer}')"
  fi
  # With -D the launch pid is the daemon itself (the daemon's own pid file says the same).
  for d in slurmctld slurmd; do mv -f "$DIR/$d.pid.launch" "$DIR/$d.pid"; done
  link_etc_conf
  echo "SLURM up: node $NODE $state, state in $DIR"
  echo "export SLURM_CONF=$CONF"
}

# TERM the recorded pid, wait up to 20 s, then KILL.
kill_wait() {
  local name=$1 pid i
  pid=$(alive_pid "$name") || { rm -f "$DIR/$name.pid"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "$name ($pid) ignored SIGTERM; SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$DIR/$name.pid"
  echo "stopped $name ($pid)"
}

stop_daemons() {
  local f
  # Pids of a start that failed half-way are in *.pid.launch.
  for f in slurmd slurmctld; do
    [[ -s $DIR/$f.pid.launch && ! -s $DIR/$f.pid ]] && mv -f "$DIR/$f.pid.launch" "$DIR/$f.pid"
    rm -f "$DIR/$f.pid.launch"
  done
  kill_wait slurmd
  kill_wait slurmctld
  # Fallback for lost pid files: daemons started with exactly this conf, found by their command
  # line in /proc (no pkill: procps may be absent, and other slurm daemons must survive).
  local p cmdline stray=""
  for p in /proc/[0-9]*; do
    cmdline=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) || continue
    if [[ $cmdline =~ ^(/usr/sbin/)?slurm(ctld|d)\ -D\ -f\ $CONF\  ]]; then stray+=" ${p#/proc/}"; fi
  done
  if [[ -n $stray ]]; then
    echo "killing daemons of $CONF without pid files:$stray" >&2
    kill -TERM $stray 2>/dev/null || true
    sleep 2
    kill -KILL $stray 2>/dev/null || true
  fi
}

cmd_stop() {
  # Cancel jobs first, so that no slurmstepd or job process outlives slurmd.
  if alive_pid slurmctld >/dev/null; then
    local jobs i
    jobs=$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
      for i in $(seq 30); do
        [[ -z $(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) ]] && break
        sleep 1
      done
    fi
  fi
  stop_daemons
  kill_wait munged   # only when start started it (munged.pid exists)
  unlink_etc_conf
  echo "SLURM stopped ($DIR)"
}

cmd_status() {
  local d pid ok=0
  for d in munged slurmctld slurmd; do
    if pid=$(alive_pid "$d"); then echo "$d: running (pid $pid)"; else echo "$d: not running (from $DIR)"; fi
  done
  if [[ -f $CONF ]] && SLURM_CONF=$CONF sinfo >/dev/null 2>&1; then
    SLURM_CONF=$CONF sinfo
    SLURM_CONF=$CONF squeue
    echo "export SLURM_CONF=$CONF"
  else
    echo "no controller answers for $CONF"
    ok=1
  fi
  return $ok
}

case $CMD in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) usage ;;
esac

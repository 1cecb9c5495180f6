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
# Process tracking (LMFORGE_SLURM_PROCTRACK=auto|cgroup|linuxproc; auto = cgroup when the cgroup v1
# freezer is writable, as in this sandbox). proctrack/cgroup is what real clusters run: job-step
# signals (scancel --signal, --signal=SIG@N without B:) reach only the step's tasks (e.g. torchrun,
# not its workers), and whatever is left when a step ends is killed. proctrack/linuxproc signals
# every descendant, but loses processes whose parent died: torchrun killed by an unhandled signal
# leaves its workers running after the job, and the step takes ~60 s to finish.
#
# Timing (measured here): cred_expire=10 and sched_interval=2 start a requeued job again ~11-12 s
# after it ended (default ~2 min). slurmctld checks time limits and --signal warnings every 30 s:
# a `--signal=SIG@N` warning comes 0-30 s EARLY (sent once end - now <= N + 30), and the time limit
# kill (SIGTERM, SIGKILL after KillWait=5 s) up to 30 s LATE. `sbatch --wait` follows a job through
# requeues; it polls after 2 s, then every 8 s (MinJobAge=17, below).
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
PROCTRACK=${LMFORGE_SLURM_PROCTRACK:-auto}
[[ $PROCTRACK =~ ^(auto|cgroup|linuxproc)$ ]] || die "LMFORGE_SLURM_PROCTRACK: auto, cgroup or linuxproc"

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

# A start that failed: logs, then stop the daemons it launched (the port stays free for a retry).
start_failed() {
  echo "local_cluster.sh: $*" >&2
  show_logs
  stop_daemons >/dev/null 2>&1 || true
  exit 1
}

require_tools() {
  local c
  [[ $(id -u) == 0 ]] || die "must run as root (it starts munged, slurmctld and slurmd)"
  for c in munged munge unmunge slurmctld slurmd sbatch srun sinfo squeue scontrol scancel; do
    command -v "$c" >/dev/null 2>&1 || die "'$c' not found; install SLURM with: $APT_LINE"
  done
}

start_munge() {
  if munge_works; then
    alive_pid munged >/dev/null || echo "munged: already running, reused (stop leaves it alone)"
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
  local d
  for d in /run/munge /var/lib/munge /var/log/munge; do
    [[ -d $d ]] || install -d -o munge -g munge -m 0755 "$d"
  done
  # The munge user may not reach STATE_DIR (pytest's temporary directories are 0700 root), so
  # munged logs under /var/log/munge; STATE_DIR/munged.log links to it.
  local log=/var/log/munge/munged-lmforge.log
  rm -f "$DIR/munged.log" "$log"
  install -o munge -g munge -m 0644 /dev/null "$log"
  ln -s "$log" "$DIR/munged.log"
  # munged daemonizes and writes its pid file; we copy the pid into STATE_DIR.
  runuser -u munge -- munged --log-file="$log" --pid-file=/run/munge/munged.pid \
    || fail "munged did not start"
  local i
  for i in $(seq 50); do munge_works && break; sleep 0.2; done
  munge_works || fail "munged started but munge/unmunge fails"
  cp /run/munge/munged.pid "$DIR/munged.pid"
}

# proctrack/cgroup needs a writable cgroup v1 freezer (22.05's cgroup/v2 wants systemd delegation).
resolve_proctrack() {
  [[ $PROCTRACK == auto ]] || return 0
  local probe=/sys/fs/cgroup/freezer/lmforge_probe_$$
  if mkdir "$probe" 2>/dev/null && rmdir "$probe"; then PROCTRACK=cgroup; else PROCTRACK=linuxproc; fi
}

write_conf() {
  resolve_proctrack
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
# No accounting daemon; cgroups only to track processes (see the top).
ProctrackType=proctrack/$PROCTRACK
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
# Finished jobs stay visible to scontrol / squeue -t all for ~17-40 s (no sacct here). It also
# sets sbatch --wait's poll period: 2 s, then every 8 s (MinJobAge >= 18 makes it every 32 s).
MinJobAge=17
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=60
MessageTimeout=10
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE ${hw}State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  # Read from the directory of slurm.conf; only the freezer (process tracking) is used.
  rm -f "$DIR/cgroup.conf"
  if [[ $PROCTRACK == cgroup ]]; then
    cat >"$DIR/cgroup.conf" <<EOF
$MARKER
CgroupPlugin=cgroup/v1
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
  fi
}

link_etc_conf() {
  [[ ${LMFORGE_SLURM_ETC:-1} != 0 ]] || return 0
  # Foreign: an existing file (or a link to one) that this script did not write.
  if [[ -e $ETC_CONF ]] && ! grep -qF "$MARKER" "$ETC_CONF"; then
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

# StateSaveLocation of the controller that answers on our port: tells ours from another's.
ctld_state_dir() {
  [[ -f $CONF ]] || return 0
  SLURM_CONF=$CONF scontrol show config 2>/dev/null | sed -n 's/^StateSaveLocation *= *//p' || true
}

cmd_start() {
  require_tools
  if alive_pid slurmctld >/dev/null && alive_pid slurmd >/dev/null \
    && [[ $(ctld_state_dir) == "$DIR/state" && -n $(node_state) ]]; then
    echo "already running: $DIR (node $NODE: $(node_state))"
    link_etc_conf
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  # Whatever is left of an earlier start (dead controller, lost pid files) goes first.
  stop_daemons
  mkdir -p "$DIR/state" "$DIR/spool"
  start_munge
  write_conf
  local other
  other=$(ctld_state_dir)
  [[ -z $other ]] || die "another slurmctld (state: $other) already answers on this port; stop it first"
  rm -f "$DIR"/slurm*.log "$DIR"/slurm*.pid "$DIR"/slurm*.pid.launch
  # -i: ignore unreadable state files from an unclean stop (jobs recovered when readable).
  start_daemon slurmctld -i
  start_daemon slurmd -N "$NODE"
  # Wait until the node has registered (idle); a drain recovered from old state is lifted.
  local i d state=""
  for i in $(seq 60); do
    for d in slurmctld slurmd; do
      kill -0 "$(<"$DIR/$d.pid.launch")" 2>/dev/null || start_failed "$d exited during start-up"
    done
    state=$(node_state)
    [[ $state =~ ^(idle|mixed|allocated)$ ]] && break
    if [[ $state == drain* ]]; then
      SLURM_CONF=$CONF scontrol update NodeName="$NODE" State=RESUME || true
    fi
    sleep 0.5
  done
  if [[ ! $state =~ ^(idle|mixed|allocated)$ ]]; then
    SLURM_CONF=$CONF sinfo -R >&2 || true
    start_failed "node $NODE not idle after 30 s (state: '${state:-no answer}')"
  fi
  # With -D the launch pid is the daemon itself (the daemon's own pid file says the same).
  for d in slurmctld slurmd; do mv -f "$DIR/$d.pid.launch" "$DIR/$d.pid"; done
  link_etc_conf
  echo "SLURM up: node $NODE $state, proctrack/$PROCTRACK, state in $DIR"
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
    cmdline=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    if [[ $cmdline =~ ^(/usr/sbin/)?slurm(ctld|d)\ -D\ -f\ "$CONF"\  ]]; then stray+=" ${p#/proc/}"; fi
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
  if alive_pid slurmctld >/dev/null && [[ $(ctld_state_dir) == "$DIR/state" ]]; then
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
  local p
  for p in /proc/[0-9]*; do
    if [[ $(tr '\0' ' ' 2>/dev/null <"$p/cmdline") == slurmstepd* ]]; then
      echo "warning: slurmstepd ${p#/proc/} still running (a job that was not cancelled)" >&2
    fi
  done
  echo "SLURM stopped ($DIR)"
}

cmd_status() {
  local d pid ok=0
  for d in munged slurmctld slurmd; do
    if pid=$(alive_pid "$d"); then echo "$d: running (pid $pid)"; else echo "$d: not running (from $DIR)"; fi
  done
  if [[ -f $CONF ]] && SLURM_CONF=$CONF sinfo >/dev/null 2>&1; then
    grep '^ProctrackType' "$CONF"
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

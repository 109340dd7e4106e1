"""The contract between whatever starts a training process (a launch backend, Kubernetes, Azure ML) and
the training runtime inside it. Both sides import this leaf module; neither imports the other.

The distributed variables themselves are the ones Azure ML sets (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK, NODE_RANK; TF_CONFIG; the MPI rank variables); these are azulite's additions.
"""

import signal

#: Exit code of a training process that was asked to stop (SIGTERM, a spot eviction notice), finished its
#: step, committed a checkpoint and exited cleanly. A launcher marks the job ``preempted`` and requeues it.
#: 75 is EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry".
EXIT_PREEMPTED = 75
#: Exit code of a training process that failed on an error no restart can fix: a setting, a URI or
#: credentials wrong as given (``azulite.train.exit_code`` maps azulite's errors to it). A launcher ends the
#: job failed at once: no in-job restart (torchrun's max_restarts), no retry (max_retries).
#: 78 is EX_CONFIG of sysexits.h: "something was found in an unconfigured or misconfigured state".
EXIT_CONFIG = 78

#: What a launcher puts before a command it runs through ``sh -c``/``bash -c`` (shell syntax: ``cd src &&
#: python train.py``). A stop signal reaches the shell and the command alike (one process group); without it
#: the shell dies at once (143) while the command still commits its checkpoint, orphaned. With it the shell
#: waits for the command and exits with its code (75): POSIX runs a trap only once the foreground command
#: has ended, with ``$?`` its status (measured with dash and bash). Its children keep the default action.
SHELL_STOP_TRAP = "trap 'exit $?' TERM INT; "

#: The job's id in the launcher's store (absent when a script runs by hand).
ENV_JOB_ID = "AZULITE_JOB_ID"
#: 1-based attempt number: 1 for the first run, incremented on each requeue after preemption.
ENV_ATTEMPT = "AZULITE_ATTEMPT"

#: The output a job's checkpoints go to: ``outputs.checkpoints`` in the job spec. ``job show`` lists the
#: committed checkpoints found there.
CHECKPOINT_OUTPUT = "checkpoints"

#: The signal that makes a training process (``azulite.train.init`` registers it) and a rank runner print
#: every thread's Python stack to their log, then go on: how a launcher shows where a rank that does not
#: stop is stuck, with no debugger on the machine. A launcher sends it only to
#: processes that catch it, since its default action ends a process.
STACK_DUMP_SIGNAL = signal.SIGUSR1
#: Seconds a rank may keep running after a stop signal (SIGTERM/SIGINT) before its rank runner has it (and
#: itself) print their stacks into the rank's log; 0 turns that off. The default stays under torchrun's 30 s
#: between SIGTERM and SIGKILL of its workers, so the stacks are written before torchrun kills a stuck rank.
ENV_STOP_DUMP_S = "AZULITE_STOP_DUMP_S"
STOP_DUMP_S_DEFAULT = 20.0

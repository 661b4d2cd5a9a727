/* aenv-init: the guest's PID 1 in the real root. Usage: aenv-init -- PROGRAM [ARG...]
 *
 * Starts PROGRAM, reaps every child re-parented to it (orphans), forwards the signals a
 * supervisor sends (SIGTERM, SIGINT, ...) to PROGRAM, and exits with PROGRAM's status once it
 * exits. Unlike tini it waits for signals with no timeout (sigwaitinfo): an idle guest's PID 1
 * never wakes, which matters when every wakeup is emulated on the host (docs/density.md).
 * No wakeup is needed: SIGCHLD stays pending while it is blocked, and one pending SIGCHLD
 * stands for any number of exited children, all reaped in one pass.
 *
 * Built static with musl by aenv.guest.initramfs (a template image may have no libc we can
 * use). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* Signals raised by a fault in this process itself: never blocked (blocking them makes a
 * fault fatal without a handler), as in tini. */
static const int SYNCHRONOUS[] = {SIGFPE, SIGILL, SIGSEGV, SIGBUS, SIGABRT, SIGTRAP, SIGSYS,
                                  SIGTTIN, SIGTTOU};

static int status_code(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3 || strcmp(argv[1], "--") != 0) {
        fprintf(stderr, "usage: %s -- PROGRAM [ARG...]\n", argv[0]);
        return 2;
    }
    sigset_t waited, previous;
    sigfillset(&waited);
    for (size_t i = 0; i < sizeof SYNCHRONOUS / sizeof SYNCHRONOUS[0]; i++)
        sigdelset(&waited, SYNCHRONOUS[i]);
    if (sigprocmask(SIG_SETMASK, &waited, &previous) != 0) {
        perror("aenv-init: sigprocmask");
        return 1;
    }
    pid_t child = fork();
    if (child < 0) {
        perror("aenv-init: fork");
        return 1;
    }
    if (child == 0) {
        sigprocmask(SIG_SETMASK, &previous, NULL);
        execvp(argv[2], &argv[2]);
        fprintf(stderr, "aenv-init: exec %s: %s\n", argv[2], strerror(errno));
        _exit(127);
    }
    for (;;) {
        siginfo_t info;
        int sig = sigwaitinfo(&waited, &info);
        if (sig < 0) {
            if (errno == EINTR) continue;
            perror("aenv-init: sigwaitinfo");
            return 1;
        }
        if (sig != SIGCHLD) {
            kill(child, sig);
            continue;
        }
        for (;;) {
            int status;
            pid_t done = waitpid(-1, &status, WNOHANG);
            if (done <= 0) break;
            if (done == child) return status_code(status);
        }
    }
}

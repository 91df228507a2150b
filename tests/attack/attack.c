/* What an attacker who has taken the agent over would try, run inside the agent.
 *
 * Preloaded (LD_PRELOAD) into the agent by tests/confinement.rs. The constructor only
 * installs a handler for SIGUSR2 and starts nothing: a thread created before the agent
 * confines itself would be outside the confinement, which an attacker who takes the agent
 * over later never is. The test sends SIGUSR2 once the agent is up; the handler then runs
 * in one of the agent's own threads, tries each thing the environment names, and writes one
 * line per attempt to standard error, which the test reads:
 *
 *   ATTACK <what> <target>: allowed
 *   ATTACK <what> <target>: denied (<errno text>)
 *
 * ATTACK_READ, ATTACK_CREATE: paths separated by ':'; ATTACK_CONNECT: TCP ports on
 * 127.0.0.1 separated by ':'; ATTACK_UNIX: a Unix socket's path; ATTACK_EXEC: a program
 * run as `PROGRAM -c 'exit 7'`. Not async-signal-safe in every call (dprintf), which a test
 * may afford.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static void say(const char *what, const char *target, int err) {
    if (err == 0)
        dprintf(2, "ATTACK %s %s: allowed\n", what, target);
    else
        dprintf(2, "ATTACK %s %s: denied (%s)\n", what, target, strerror(err));
}

/* Calls `try` with each ':'-separated item of the variable `name`. */
static void each(const char *name, void (*try)(const char *)) {
    const char *value = getenv(name);
    if (!value)
        return;
    char buffer[4096];
    snprintf(buffer, sizeof buffer, "%s", value);
    char *save = NULL;
    for (char *item = strtok_r(buffer, ":", &save); item; item = strtok_r(NULL, ":", &save))
        try(item);
}

static void try_read(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
        char byte;
        if (read(fd, &byte, 1) < 0)
            err = errno;
        close(fd);
    }
    say("read", path, err);
}

static void try_create(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
        if (write(fd, "owned\n", 6) < 0)
            err = errno;
        close(fd);
        unlink(path);
    }
    say("create", path, err);
}

static void try_connect(const char *port) {
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(atoi(port))};
    inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
        if (connect(fd, (struct sockaddr *)&address, sizeof address) < 0)
            err = errno;
        close(fd);
    }
    say("connect", port, err);
}

static void try_unix(const char *path) {
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    snprintf(address.sun_path, sizeof address.sun_path, "%s", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
        if (connect(fd, (struct sockaddr *)&address, sizeof address) < 0)
            err = errno;
        close(fd);
    }
    say("unix", path, err);
}

static void try_exec(const char *program) {
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC) < 0) {
        say("exec", program, errno);
        return;
    }
    pid_t child = fork();
    if (child == 0) {
        char *argv[] = {(char *)program, "-c", "exit 7", NULL};
        execv(program, argv);
        int err = errno;
        if (write(pipe_fds[1], &err, sizeof err) < 0)
            _exit(126);
        _exit(127);
    }
    close(pipe_fds[1]);
    int err = 0, status = 0;
    if (child < 0)
        err = errno;
    else {
        if (read(pipe_fds[0], &err, sizeof err) != sizeof err)
            err = 0;
        waitpid(child, &status, 0);
        if (err == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 7))
            err = ECHILD;
    }
    close(pipe_fds[0]);
    say("exec", program, err);
}

static void attack(int signal) {
    (void)signal;
    dprintf(2, "ATTACK begin\n");
    each("ATTACK_READ", try_read);
    each("ATTACK_CREATE", try_create);
    each("ATTACK_CONNECT", try_connect);
    each("ATTACK_UNIX", try_unix);
    each("ATTACK_EXEC", try_exec);
    dprintf(2, "ATTACK end\n");
}

__attribute__((constructor)) static void arm(void) {
    struct sigaction action = {.sa_handler = attack};
    sigemptyset(&action.sa_mask);
    sigaction(SIGUSR2, &action, NULL);
}

/*
 * A main() for the fuzz targets when they are built without libFuzzer
 * (gcc, or any compiler with plain sanitizers): runs every input file
 * named on the command line, or every file in a named directory, once,
 * in name order.  This is how the corpus and the regression inputs are
 * replayed under AddressSanitizer, UndefinedBehaviorSanitizer and
 * LeakSanitizer at every kernel level without clang.
 */
#define _DEFAULT_SOURCE
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The input being run, named when it aborts: the sanitizers' reports and
 * the target's own say what went wrong, not on which file. */
static const char *current;

static void name_input(int sig)
{
    static const char msg[] = "replay: the failing input is ";
    if (current) {
        (void)!write(2, msg, sizeof msg - 1);
        (void)!write(2, current, strlen(current));
        (void)!write(2, "\n", 1);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static int run_file(const char *path)
{
    current = path;
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    /* an exact-size copy, so that the sanitizers see a read past the input */
    uint8_t *data = (uint8_t *)malloc(n > 0 ? (size_t)n : 1);
    size_t got = n > 0 ? fread(data, 1, (size_t)n, f) : 0;
    fclose(f);
    if (got != (size_t)(n > 0 ? n : 0)) {
        fprintf(stderr, "%s: short read\n", path);
        free(data);
        return 1;
    }
    LLVMFuzzerTestOneInput(data, got);
    free(data);
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int run_dir(const char *dir, size_t *count)
{
    DIR *d = opendir(dir);
    if (!d) {
        perror(dir);
        return 1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = (char **)realloc(names, cap * sizeof *names);
        }
        size_t len = strlen(dir) + strlen(e->d_name) + 2;
        names[n] = (char *)malloc(len);
        snprintf(names[n], len, "%s/%s", dir, e->d_name);
        n++;
    }
    closedir(d);
    qsort(names, n, sizeof *names, by_name);
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        if (stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
            rc |= run_file(names[i]);
            (*count)++;
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

int main(int argc, char **argv)
{
    size_t count = 0;
    int rc = 0;
    signal(SIGABRT, name_input);
    signal(SIGSEGV, name_input);
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            perror(argv[i]);
            return 1;
        }
        if (S_ISDIR(st.st_mode)) {
            rc |= run_dir(argv[i], &count);
        } else {
            rc |= run_file(argv[i]);
            count++;
        }
    }
    printf("%s: %zu inputs replayed\n", argv[0], count);
    return rc;
}

// One diagnostic line on stderr, prefixed "fakecuda: " and written with a single call (so lines
// from several threads never interleave): how every part of the double reports what it refused.
#pragma once
#include <cstdarg>
#include <cstdio>

namespace fakecuda {

__attribute__((format(printf, 1, 2))) inline void complain(const char* fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fakecuda: %s\n", buf);
}

}  // namespace fakecuda

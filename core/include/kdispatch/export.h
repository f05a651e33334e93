/*
 * KDISPATCH_API marks what libkdispatch.so exports. The core is compiled with
 * hidden visibility; every public header opens its namespace as
 * `namespace kdispatch KDISPATCH_API { ... }`, so what a public header
 * declares is exported and nothing else is (internal headers in core/src open
 * a plain `namespace kdispatch`). A test compares the library's dynamic
 * symbols with the public headers.
 */
#ifndef KDISPATCH_EXPORT_H_
#define KDISPATCH_EXPORT_H_

#if defined(__GNUC__) || defined(__clang__)
#define KDISPATCH_API __attribute__((visibility("default")))
#else
#define KDISPATCH_API
#endif

#endif /* KDISPATCH_EXPORT_H_ */

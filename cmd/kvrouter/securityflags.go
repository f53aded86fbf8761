package main

import (
	"fmt"
	"io"
	"log/slog"
	"strings"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/netaddr"
)

// Security flags `kvrouter serve` reads itself, before config.go's table
// (runServe): kept apart so they can change without touching the Dynamo
// flag names there.
//
//	--admin-open-to-loopback PATH[,PATH…]  (KVROUTER_ADMIN_OPEN_TO_LOOPBACK)
//
// names admin paths served without the admin token to callers connecting
// from loopback (api/adminexempt.go): only api.LoopbackExemptPaths
// (/busy_threshold, /workers, /debug/route) may be named, and only with a
// loopback --http-addr. make run sets it to /busy_threshold (deploy/local/run.sh
// says why; SECURITY.md).

const (
	adminOpenFlag = "admin-open-to-loopback"
	adminOpenEnv  = "KVROUTER_ADMIN_OPEN_TO_LOOPBACK"
)

// securityFlagsUsage is printed after the table's usage for --help.
func securityFlagsUsage(w io.Writer) {
	fmt.Fprintf(w, "  -%s PATH[,PATH...]\n    \tadmin paths served WITHOUT the admin token to callers connecting from loopback, each use logged (possible: %s; needs a loopback --http-addr; make run: /busy_threshold) (env %s)\n",
		adminOpenFlag, strings.Join(api.LoopbackExemptPaths, ", "), adminOpenEnv)
}

// takeSecurityFlags removes this file's flags from args (as -name, --name,
// with "=value" or the next argument) and returns the rest for parseServe
// with their values (the environment's when no flag is given). Arguments
// after "--" are left alone.
func takeSecurityFlags(args []string, getenv func(string) string) (rest, open []string, err error) {
	given := false
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			rest = append(rest, args[i:]...)
			break
		}
		name, value, hasValue := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		if !strings.HasPrefix(a, "-") || name != adminOpenFlag {
			rest = append(rest, a)
			continue
		}
		if !hasValue {
			if i+1 == len(args) {
				return nil, nil, fmt.Errorf("flag needs an argument: -%s", adminOpenFlag)
			}
			i++
			value = args[i]
		}
		given = true
		open = append(open, splitPaths(value)...)
	}
	if !given {
		open = splitPaths(getenv(adminOpenEnv))
	}
	if err := api.CheckAdminOpenToLoopback(open); err != nil {
		return nil, nil, fmt.Errorf("--%s: %w", adminOpenFlag, err)
	}
	return rest, open, nil
}

func splitPaths(v string) []string {
	var out []string
	for p := range strings.SplitSeq(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// applySecurityFlags puts the values into the parsed configuration: the
// exemption trusts loopback callers, so it needs a loopback --http-addr
// (off loopback every proxy and sidecar on the host would be "loopback").
func applySecurityFlags(c *serveConfig, open []string) error {
	if len(open) == 0 {
		return nil
	}
	if !netaddr.LoopbackListen(c.HTTPAddr) {
		return fmt.Errorf("--%s trusts callers on this host: it needs a loopback --http-addr, got %s", adminOpenFlag, c.HTTPAddr)
	}
	c.AdminOpenToLoopback = open
	return nil
}

// warnAdminAccess logs, at start, what the admin endpoints take: every
// replica without an admin token says loudly that every local user (every
// caller, off loopback) may register workers — and so receive other
// users' prompts — deregister and move them and retune the router.
func warnAdminAccess(c serveConfig, log *slog.Logger) {
	// With a token, the exemption's own warning (api/adminexempt.go) names
	// the paths left open.
	if c.AdminToken == "" {
		log.Warn("NO ADMIN TOKEN: the admin endpoints are open — anyone who can reach " + c.HTTPAddr +
			" may register a worker (and receive other users' prompts and the worker API key), deregister or move workers and retune the router; give --admin-token-file (make run does unless KVROUTER_RUN_ADMIN_TOKEN=0)")
		if len(c.AdminOpenToLoopback) > 0 {
			log.Warn("--"+adminOpenFlag+" has no effect without an admin token: everything is open", "paths", c.AdminOpenToLoopback)
		}
	}
}

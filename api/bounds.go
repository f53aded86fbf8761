package api

import (
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"regexp"
	"strings"
	"syscall"

	"github.com/kvrouter/kvrouter/router"
)

// Input and resource bounds (issue 16 item 5). Each bound's default and
// reason are in DESIGN.md, "Bounds".

// Defaults of the Config bounds.
const (
	defaultMaxWorkers = 1024
	defaultMaxModels  = 256
	defaultMaxQueue   = 1024
)

// errLocalAddress: a worker address on this host or its link (loopback,
// link-local, unspecified, multicast), refused unless AllowLoopbackWorkers.
var errLocalAddress = errors.New("address is loopback, link-local, unspecified or multicast")

// checkWorkerURL refuses a worker base URL the proxy must not be pointed
// at: anything but http(s) with a host, userinfo (a credential that would
// travel in every proxied request and show in /workers), a query or
// fragment (the proxy appends the API path), and, unless allowLocal,
// addresses on this host or its link (the proxy would be a way into the
// replica's own ports or a cloud metadata endpoint: server-side request
// forgery). A hostname is checked again when dialled (dialGuard), as it
// may resolve anywhere.
func checkWorkerURL(raw string, allowLocal bool) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("worker url: %w", err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("worker url scheme %q: want http or https", u.Scheme)
	case u.Opaque != "":
		return errors.New("worker url must be http(s)://host[:port][/path]")
	case u.User != nil:
		return errors.New("worker url must not carry userinfo (user:password@)")
	case u.RawQuery != "" || u.Fragment != "" || strings.HasSuffix(raw, "?") || strings.HasSuffix(raw, "#"):
		return errors.New("worker url must not have a query or fragment")
	case u.Hostname() == "":
		return errors.New("worker url has no host")
	}
	if p := u.Port(); p != "" {
		if _, err := netip.ParseAddrPort("0.0.0.0:" + p); err != nil || p == "0" {
			return fmt.Errorf("worker url port %q", p)
		}
	}
	if allowLocal {
		return nil
	}
	host := strings.ToLower(strings.TrimSuffix(u.Hostname(), "."))
	if host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return fmt.Errorf("worker url host %q: %w (set AllowLoopbackWorkers for a local cluster)", u.Hostname(), errLocalAddress)
	}
	if ip, err := netip.ParseAddr(host); err == nil && localAddr(ip) {
		return fmt.Errorf("worker url host %s: %w (set AllowLoopbackWorkers for a local cluster)", ip, errLocalAddress)
	}
	return nil
}

// localAddr reports addresses of this host or its link: loopback
// (127/8, ::1), unspecified (0.0.0.0, ::, which dial this host),
// link-local (169.254/16 with the cloud metadata endpoint, fe80::/10) and
// multicast. IPv4 mapped into IPv6 counts as its IPv4 address.
func localAddr(ip netip.Addr) bool {
	ip = ip.Unmap()
	return ip.IsLoopback() || ip.IsUnspecified() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() ||
		ip.IsInterfaceLocalMulticast() || ip.IsMulticast()
}

// dialGuard is the worker dialer's Control hook: it refuses local
// addresses after name resolution, so a hostname that resolves (or is
// rebound) to 127.0.0.1 or 169.254.169.254 reaches nothing.
func dialGuard(allowLocal bool) func(network, address string, _ syscall.RawConn) error {
	return func(_, address string, _ syscall.RawConn) error {
		if allowLocal {
			return nil
		}
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return fmt.Errorf("dial %s: %w", address, err)
		}
		if localAddr(ap.Addr()) {
			return fmt.Errorf("dial %s: %w", address, errLocalAddress)
		}
		return nil
	}
}

// baseWorkerID is the worker id of a router worker id (rank ids are
// "id#rank").
func baseWorkerID(id router.WorkerID) string {
	s, _, _ := strings.Cut(string(id), "#")
	return s
}

// registryCounts counts the registered workers (not ranks) and models, and
// whether the given worker and model are among them.
func (s *Server) registryCounts(worker, model string) (workers, models int, knownWorker, knownModel bool) {
	seen := make(map[string]bool)
	ms := s.rep.Models()
	for _, m := range ms {
		knownModel = knownModel || m == model
		rt, ok := s.rep.Router(m)
		if !ok {
			continue
		}
		for _, w := range rt.Workers() {
			seen[baseWorkerID(w.ID)] = true
		}
	}
	return len(seen), len(ms), seen[worker], knownModel
}

// capPriority bounds the client-set nvext.agent_hints.priority by the cap
// of the request's API key (MaxPriorityByKey), else MaxPriority: a client
// may lower its priority freely, not jump every queue. A key's own cap
// counts only when keys are checked (APIKeys set, requireKey ran): on an
// open endpoint anyone could send any bearer.
func (s *Server) capPriority(key string, p int) int {
	limit := s.cfg.MaxPriority
	if l, ok := s.cfg.MaxPriorityByKey[key]; ok && key != "" && len(s.cfg.APIKeys) > 0 {
		limit = l
	}
	return min(p, limit)
}

// userinfoRE matches the userinfo of a URL (scheme://user:pass@).
var userinfoRE = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s"]+@`)

// redacted is what a credential is replaced with.
const redacted = "[REDACTED]"

// redact removes credentials from a string this package prints (an error
// relayed to a client, a log line, the status document): URL userinfo
// (nats://user:pass@host) and the configured admin token and API keys.
func (s *Server) redact(msg string) string {
	msg = userinfoRE.ReplaceAllString(msg, "${1}"+redacted+"@")
	for _, secret := range s.secrets() {
		msg = strings.ReplaceAll(msg, secret, redacted)
	}
	return msg
}

// secrets are the configured credentials (short ones are skipped: replacing
// every "a" in a message would destroy it and protect nothing).
func (s *Server) secrets() []string {
	var out []string
	for _, k := range append([]string{s.cfg.AdminToken, s.cfg.WorkerAPIKey}, s.cfg.APIKeys...) {
		if len(k) >= 6 {
			out = append(out, k)
		}
	}
	for _, k := range s.cfg.WorkerAPIKeys {
		if len(k) >= 6 {
			out = append(out, k)
		}
	}
	for k := range s.cfg.MaxPriorityByKey {
		if len(k) >= 6 {
			out = append(out, k)
		}
	}
	return out
}

// secretKeyRE matches document keys whose values are credentials: the
// word must stand alone between underscores, so "admin_token" matches and
// "tokenizer_check" or "max_tokens" do not.
var secretKeyRE = regexp.MustCompile(`(?i)(^|_)(password|passwd|secret|token|credentials?|api_?key|nkey|seed)($|_)`)

// redactDoc returns a copy of a JSON-like document (the replica's
// /cluster/status) with credentials removed: values under keys that name
// a credential, and credentials inside every string.
func (s *Server) redactDoc(v any) any {
	switch v := v.(type) {
	case string:
		return s.redact(v)
	case error:
		return s.redact(v.Error())
	case map[string]any:
		out := make(map[string]any, len(v))
		for k, x := range v {
			if str, isStr := x.(string); isStr && str != "" && secretKeyRE.MatchString(k) {
				out[k] = redacted
				continue
			}
			out[k] = s.redactDoc(x)
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = s.redactDoc(x)
		}
		return out
	case []string:
		out := make([]string, len(v))
		for i, x := range v {
			out[i] = s.redact(x)
		}
		return out
	}
	return v
}

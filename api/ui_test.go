package api

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/router"
)

// uiGet answers GET path on s with the optional bearer token.
func uiGet(s *Server, path, token string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodGet, path, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, req)
	return rec
}

// The status page is served, with its assets, as the types a browser will
// run under the page's own CSP; nothing else under /ui/ is.
func TestUIServesPageAndAssets(t *testing.T) {
	s := New(Config{Registry: prometheus.NewRegistry()}, newFakeReplica("m", router.DefaultConfig()))
	for path, ctype := range map[string]string{"/ui": "text/html", "/ui/ui.js": "text/javascript", "/ui/ui.css": "text/css"} {
		rec := uiGet(s, path, "")
		if rec.Code != http.StatusOK || !strings.HasPrefix(rec.Header().Get("Content-Type"), ctype) {
			t.Fatalf("%s: HTTP %d, %q", path, rec.Code, rec.Header().Get("Content-Type"))
		}
		if csp := rec.Header().Get("Content-Security-Policy"); !strings.Contains(csp, "script-src 'self'") || !strings.Contains(csp, "connect-src 'self'") {
			t.Fatalf("%s: CSP %q", path, csp)
		}
	}
	if !strings.Contains(uiGet(s, "/ui", "").Body.String(), `<script src="/ui/ui.js"`) {
		t.Fatal("the page does not load its script")
	}
	for _, path := range []string{"/ui/index.html", "/ui/../server.go", "/ui/ui.go"} {
		if rec := uiGet(s, path, ""); rec.Code == http.StatusOK {
			t.Fatalf("%s: HTTP 200", path)
		}
	}
}

// uiPaths are the same-origin paths the page's files name in string
// literals and attributes: every endpoint it fetches and asset it loads.
func uiPaths(t *testing.T) []string {
	t.Helper()
	re := regexp.MustCompile(`["'](/[a-z][a-z0-9_./-]*(?:\?[^"']*)?)["']`)
	var out []string
	for _, name := range []string{"ui/index.html", "ui/ui.js"} {
		b, err := uiFiles.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			out = append(out, m[1])
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Every path the page names exists and answers 200 on a replica with an
// admin token, given the token; the page itself needs none. A renamed
// endpoint the script still fetches fails here, not in an operator's
// browser.
func TestUIReferencesOnlyLiveEndpoints(t *testing.T) {
	s := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "tok", ProtectStatus: true, Decisions: decisionlog.New(16, nil)},
		newFakeReplica("m", router.DefaultConfig()))
	paths := uiPaths(t)
	for _, want := range []string{"/cluster/status", "/cluster/status?digest=0", "/debug/decisions?limit=20", "/ui/ui.js", "/ui/ui.css"} {
		if !slices.Contains(paths, want) {
			t.Fatalf("the page does not name %s (found %v): this test would check nothing", want, paths)
		}
	}
	for _, p := range paths {
		if rec := uiGet(s, p, "tok"); rec.Code != http.StatusOK {
			t.Errorf("%s: HTTP %d %s", p, rec.Code, rec.Body)
		}
	}
	if rec := uiGet(s, "/ui", ""); rec.Code != http.StatusOK {
		t.Fatalf("/ui without the token: HTTP %d", rec.Code)
	}
	if rec := uiGet(s, "/debug/decisions?limit=20", ""); rec.Code != http.StatusUnauthorized {
		t.Fatalf("/debug/decisions without the token: HTTP %d (the page's token form relies on 401)", rec.Code)
	}
}

package api

import (
	"embed"
	"net/http"

	"github.com/gin-gonic/gin"
)

// uiFiles is the status page: one HTML document, its script and its style,
// embedded so the page needs no network beyond the replica serving it (an
// operator's browser may sit on an isolated admin network).
//
//go:embed ui/index.html ui/ui.js ui/ui.css
var uiFiles embed.FS

// uiTypes are the only files served under /ui/, with their content types.
var uiTypes = map[string]string{
	"ui.js":  "text/javascript; charset=utf-8",
	"ui.css": "text/css; charset=utf-8",
}

// uiCSP allows the page nothing but its own origin: no inline script (so
// text from the status documents can never run), no third-party fetches.
const uiCSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// statusPage answers GET /ui and GET /ui/<asset>. The page itself is served
// without the admin token (it holds no state); the endpoints it reads keep
// their own protection, and the page asks the operator for the token when
// one answers 401.
func (s *Server) statusPage(c *gin.Context) {
	name, ctype := "index.html", "text/html; charset=utf-8"
	if f := c.Param("file"); f != "" && f != "/" {
		name = f[1:]
		if ctype = uiTypes[name]; ctype == "" {
			c.Status(http.StatusNotFound)
			return
		}
	}
	b, err := uiFiles.ReadFile("ui/" + name)
	if err != nil { // cannot happen: the names are embedded
		c.Status(http.StatusInternalServerError)
		return
	}
	h := c.Writer.Header()
	h.Set("Content-Security-Policy", uiCSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-cache")
	c.Data(http.StatusOK, ctype, b)
}

package api

import (
	"errors"
	"net/http"

	"github.com/gin-gonic/gin"
)

// openAIError writes an error in OpenAI's JSON shape.
func openAIError(c *gin.Context, status int, typ, msg string) {
	c.AbortWithStatusJSON(status, gin.H{"error": gin.H{"message": msg, "type": typ, "code": status}})
}

// statusOf maps a Replica error to an HTTP status.
func statusOf(err error) int {
	switch {
	case errors.Is(err, ErrUnknownModel):
		return http.StatusNotFound
	case errors.Is(err, ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}
